"""What crosses a connection and what drives it: the message format and its validation
(``protocol``), the reactor every role runs on (``loop``) and how long it spins (``spin``)."""
