"""A fix for Triton's CPU interpreter, applied when a kernel module is imported under it."""

import triton


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a runtime loop bound into an int with `int(array of shape (1,))`,
    which NumPy >= 2.4 refuses (triton-lang/triton#9171): take the single element instead.
    Harmless once triton carries the fix; drop it then (or pin numpy < 2.4).
    """
    from triton.runtime import interpreter

    if getattr(interpreter, "_pagoda_index_fix", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched
    interpreter._pagoda_index_fix = True


if triton.knobs.runtime.interpret:
    _fix_interpreter_scalar_index()
