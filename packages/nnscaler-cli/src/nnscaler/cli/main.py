"""The ``nnscaler`` command: built-in commands plus plug-ins from installed packages.

Nothing here imports torch: ``nnscaler --help`` must answer in well under a second.
"""
from importlib import metadata
import typer

from .info import info
from .plugins import PluginGroup

app = typer.Typer(
    name="nnscaler",
    cls=PluginGroup,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _cli_version() -> str:
    try:
        return metadata.version("nnscaler-cli")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown (nnscaler-cli is not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"nnscaler-cli {_cli_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_print_version, is_eager=True,
        help="Print the version of nnscaler-cli and exit.",
    ),
) -> None:
    """[bold]nnscaler[/bold]: make single-device PyTorch training run on many processes.

    Installed nnscaler packages add their own sub-commands, listed under
    [italic]Plug-in commands[/italic] (entry-point group [cyan]nnscaler.commands[/cyan]).
    Run [cyan]nnscaler info[/cyan] to see what is installed.
    """


app.command("info")(info)


def run() -> None:
    """Console-script entry point (``nnscaler = "nnscaler.cli.main:run"``)."""
    app(prog_name="nnscaler")
