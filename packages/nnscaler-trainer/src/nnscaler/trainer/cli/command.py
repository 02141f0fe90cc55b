"""``nnscaler train`` and ``nnscaler compile``: plug-in commands of the ``nnscaler`` CLI
(entry-point group ``nnscaler.commands``). Every argument after the command goes to
`nnscaler.trainer.cli.main.main`, so dotted overrides need no declaration."""
from __future__ import annotations

import typer

__all__ = ["train_app", "compile_app"]

_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


class _PassThroughGroup(typer.core.TyperGroup):
    """A group with no sub-commands: all arguments reach the callback (as ctx.args)."""

    def parse_args(self, ctx, args):
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            import click
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit()
        ctx.args = list(args)
        return []

    def invoke(self, ctx):
        return ctx.invoke(self.callback, **ctx.params)

    def format_usage(self, ctx, formatter):
        formatter.write_usage(ctx.command_path,
                              "-f CONFIG.yaml [--nproc N] [--max_restarts N] [--print-config] [--key value ...]")


def _make(run_mode: str, help_text: str) -> typer.Typer:
    app = typer.Typer(cls=_PassThroughGroup, invoke_without_command=True, add_completion=False,
                      context_settings=_SETTINGS, help=help_text)

    @app.callback()
    def command(ctx: typer.Context) -> None:
        if any(a in ("-h", "--help") for a in ctx.args):
            typer.echo(ctx.get_help())
            raise typer.Exit(0)
        from .main import main
        raise typer.Exit(main(ctx.args, run_mode=run_mode))

    return app


_OPTIONS = """

  -f, --config FILE   the YAML config (TrainerArgs)

  --nproc N           start N local processes (torch.distributed.run); without it, run in this
                      process (one process, or under torchrun)

  --max_restarts N    restart the workers up to N times after a failure
                      (torch's elastic agent, as torchrun --max-restarts;
                      implies --nproc); each restart resumes from
                      checkpoint.resume_from: auto. Under torchrun, give
                      torchrun --max-restarts N instead

  --print-config      print the resolved config as YAML and exit

  SIGTERM, SIGINT     (to this command or to every worker; Ctrl-C sends
                      SIGINT to all) the workers finish the step, commit
                      a checkpoint and exit; exit code 143 (SIGTERM) or
                      130 (SIGINT) when this command got it, else 0

  --a.b.c VALUE       override a key (also --a.b.c=VALUE, list items --log.0.type X, --a.b! removes)
"""

train_app = _make("run", "Train the model a YAML config describes (TrainerArgs)." + _OPTIONS)
compile_app = _make("compile", "Generate the parallel code only (run_mode: compile)." + _OPTIONS)
