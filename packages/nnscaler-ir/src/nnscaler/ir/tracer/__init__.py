"""The tracer: runs the user's forward under a TorchFunctionMode and records it as an IRGraph
(`trace.py` drives `recorder.py`, whose `Tracer` offers its helpers the public surface of
`surface.py`), with what surrounds it: autocast and the model's state (`trace_state.py`), the
device it runs on (`trace_device.py`), sizes as symbols (`symbolic_int.py`), user autograd
Functions kept whole and the grad mode every Function is called in (`kept_functions.py`), value
reads as guards (`guards.py`), both branches of a decision (`branches.py`), train/eval differences
(`modes.py`), the later traces taking the first trace's results (`replay.py`), transformers' experts modules as one op (`moe_modules.py`), Python randomness
(`python_randomness.py`), and checks on example inputs (`example_inputs.py`). Private to nnscaler.ir: other packages use what `nnscaler.ir` exports."""
