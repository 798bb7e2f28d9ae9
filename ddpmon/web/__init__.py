"""The HTTP core both of ddpmon's servers stand on: the agent's /metrics endpoint
(``ddpmon.export.server``) and the node daemon (``ddpmon.daemon.server``).

Written once here, so that the two can never drift apart on who may connect and for how long:
the web config (TLS, mTLS, basic-auth users; ``config``), the bounds and deadlines
(``limits``), the basic-auth gate with its bounded bcrypt queue (``auth``), status lines and
message framing rules (``framing``), and the Host/Origin checks (``hostcheck``). Each server is
a thin layer on top: the endpoint a ``selectors`` loop inside training, the daemon an asyncio
front for its ASGI app. Nothing here imports a layer above it.
"""
