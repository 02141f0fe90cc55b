"""nnscaler.codegen: Code generation: one Python module per rank under gen_savedir, plus the manifest."""
