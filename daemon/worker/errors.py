"""A request the worker refuses: its message goes back to the client as a 400
(or the code given), and every other request carries on."""


class RequestError(ValueError):
    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


def context_advice(ctx_size: int | None = None, parallel: int | None = None, unified: bool = False) -> str:
    """What to do about a prompt longer than a slot's context, for the message that refuses it: the two
    settings that size a slot, with their values when known (a user reads this, not the docs)."""
    if unified:  # the slots share one pool (kv_unified): one slot may take all of it
        return (f"raise ctx_size (the --ctx-size flag or the ctx_size setting{f', now {ctx_size}' if ctx_size else ''}): "
                "the slots share one KV pool of ctx_size tokens (kv_unified); or send a shorter prompt")
    now = (f", now {ctx_size}", f" (now {parallel})") if ctx_size and parallel else ("", "")
    return (f"raise ctx_size (the --ctx-size flag or the ctx_size setting{now[0]}) or lower parallel{now[1]}: "
            "each slot gets ctx_size / parallel tokens; or send a shorter prompt")
