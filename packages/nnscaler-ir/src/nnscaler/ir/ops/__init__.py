"""The op registry: dimension annotations (`annotation.py`), the registry and `register_op`
(`registry.py`), the built-in torch ops' annotations (`builtin_ops.py`), the numeric check of a
user's annotation (`custom_op_check.py`), importable op names (`op_names.py`) and the random ops
(`random_ops.py`). Private to nnscaler.ir: other packages use what `nnscaler.ir` exports."""
