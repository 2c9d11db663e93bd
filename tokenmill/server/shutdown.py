"""Shutting down without cutting anyone off: on SIGTERM or Ctrl-C the server stops accepting
connections, gives the requests in flight `drain` seconds to finish, then shuts the engine
down, which ends every stream still running with an error event and `[DONE]` (and answers
non-streaming requests with 503), before uvicorn's own shutdown runs. uvicorn alone waited
5 s and then cancelled the handlers: streams just stopped, with no error and no [DONE]."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from tokenmill.engine.async_engine import AsyncEngine

logger = logging.getLogger("tokenmill.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.drain = drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while the engine drains
        for sock in sockets or []:
            sock.close()
        if not await asyncio.to_thread(self.async_engine.wait_idle, self.drain):
            logger.warning("shutting down: requests still running after %.0f s end with an "
                           "error event", self.drain)
        await asyncio.to_thread(self.async_engine.shutdown)
        await super().shutdown(sockets)
