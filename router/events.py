"""KV events from workers to routers: the bus interfaces, both buses and the worker forwarder.

- ``InProcessEventBus``: single-process runs and simulations.
- ``RedisStreamEventBus``: a cluster; one Redis Stream, one consumer group per router replica.
- ``attach_worker(bus, worker_id)``: a ``WorkerEventForwarder`` that numbers a worker's KV
  events (as drained from its engine) and publishes them.
"""

from tandem.router.bus import EventBus, EventSubscription
from tandem.router.forwarder import WorkerEventForwarder, attach_worker
from tandem.router.redis_bus import RedisStreamEventBus
from tandem.router.wire import InProcessEventBus, WorkerEvent, decode_event, encode_event

__all__ = [
    "EventBus",
    "EventSubscription",
    "InProcessEventBus",
    "RedisStreamEventBus",
    "WorkerEvent",
    "WorkerEventForwarder",
    "attach_worker",
    "decode_event",
    "encode_event",
]
