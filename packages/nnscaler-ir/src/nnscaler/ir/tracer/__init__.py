"""The tracer: runs the user's forward under a TorchFunctionMode and records it as an IRGraph
(`trace.py`), with what surrounds it: grad mode, autocast and the model's state (`trace_state.py`),
the device it runs on (`trace_device.py`), sizes as symbols (`symbolic_int.py`), user autograd
Functions kept whole (`kept_functions.py`), value reads as guards (`guards.py`), both branches of
a decision (`branches.py`), train/eval differences (`modes.py`), and checks on example inputs
(`example_inputs.py`). Private to nnscaler.ir: other packages use what `nnscaler.ir` exports."""
