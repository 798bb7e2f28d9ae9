"""The HTTP core both of ddpmon's servers stand on: the agent's /metrics endpoint
(``ddpmon.export.server``) and the node daemon (``ddpmon.daemon.server``).

Written once here, so that the two can never drift apart on what a request is, who may connect
and for how long: the web config (TLS, mTLS, basic-auth users; ``config``), the bounds and
deadlines (``limits``), the basic-auth gate with its bounded bcrypt queue (``auth``), the one
request parser with body framing and response heads (``framing``), and the Host/Origin checks
(``hostcheck``). All of it is sans-IO: each server is a thin layer that reads and writes its
own sockets, the endpoint a ``selectors`` loop inside training, the daemon an asyncio front for
its ASGI app. Nothing here imports a layer above it.
"""
