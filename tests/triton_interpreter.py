"""Triton's interpreter (TRITON_INTERPRET=1, the kernels on CPU tensors) without a cost of its own
that changes nothing it computes; applied by conftest.py in the test process and by
multiprocess.py in each worker process."""


def patch_lang_once_per_launch() -> None:
    """The interpreter's device-function calls without their re-patching of triton.language. A
    launch (GridExecutor) patches the language modules its kernel sees for the run and restores them
    after; each call of a @triton.jit helper inside it (tl.sum, a moemesh helper) patches the modules
    the helper sees again, and never restores them: an inspect.getmembers of triton.language, its
    tensor and math each time, up to a third of an interpreted model's time (measured: a GPT-OSS
    decode in test_ops_decode_kernels, 72 s against 49 s without). Once a module is patched
    within a launch, patching it again sets what is set already (its builtins are patched, so
    skipped; the rest is the same replacements), so such a call is skipped and the helper runs as it
    would. The first call that sees a module not yet patched in this launch, and a call outside a
    launch, still patch."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    executor, function = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None)
    if executor is None or function is None or not hasattr(interpreter, "_patch_lang"):
        return
    open_launches = []

    def langs_of(fn) -> set:  # what _patch_lang(fn) patches (the interpreter adds `tl` to globals)
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    launch = executor.__call__

    def launched(self, *args, **kwargs):
        open_launches.append(langs_of(self.fn))  # the modules patched so far in this launch
        try:
            return launch(self, *args, **kwargs)
        finally:
            open_launches.pop()

    device_call = function.__call__

    def called(self, *args, **kwargs):
        if not open_launches:
            return device_call(self, *args, **kwargs)
        langs = langs_of(self.fn)
        if not langs <= open_launches[-1]:
            open_launches[-1] |= langs  # patched by this call, and left so by the interpreter
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    executor.__call__ = launched
    function.__call__ = called
