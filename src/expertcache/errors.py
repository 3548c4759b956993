"""Errors that reach a user: each names the file, tensor or value at fault and what was expected."""


class ExpertCacheError(Exception):
    """A user-facing error. The CLI prints its message on one line and exits with code 2."""


class ModelChangedError(ExpertCacheError):
    """The checkpoint changed on disk while a call was reading it. The call is abandoned before
    any byte of the new version was used; the next call loads the new version. The server
    answers it with 503 and the code `model_changed`."""

    status = 503
    code = "model_changed"


class CopyError(ExpertCacheError):
    """Copying experts from the slow tier failed (a short read, an I/O error). The slots the copy
    was meant to fill are left empty, as if it had never been planned. The server answers it with
    500: the checkpoint could not be read, which is no fault of the request."""

    status = 500


class NonFiniteLogitsError(ExpertCacheError):
    """The model's logits for the next token hold NaN or infinity (an overflow in the forward, as
    fp16 weights can give): no token can be chosen from them, and a guess would be garbage that
    looks like output. The server answers it with 500: no fault of the request."""

    status = 500
