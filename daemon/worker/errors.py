"""A request the worker refuses: its message goes back to the client as a 400
(or the code given), and every other request carries on."""


class RequestError(ValueError):
    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code
