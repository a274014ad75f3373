"""Replica choice inside Ray Serve: the gateway's ``Router`` picks a worker, this honours it.

The gateway's disaggregated backend routes each prompt with ``router.Router`` (prefix- and
load-aware) and passes the chosen worker id, which is the Serve replica id, as the
``route_to`` keyword of the handle call. Serve's handle asks this request router which replica
to send to: the named one. The router's choice is final: when the named replica is not a
candidate (it died or is being replaced), the call goes to any candidate only so that Serve does
not wait for a replica that will never come back, and that replica refuses it at once with
``ReplicaGoneError`` (services/serving/workers.py checks ``route_to`` on every call). The
gateway then fails over explicitly: ``Router.mark_down`` (logged, counted in
``tandem_router_failovers_total``) and a new decision. Calls without ``route_to`` go to Serve's
default choice.

It also records the replica ids each deployment currently has (``cluster_view.known_replicas``),
which the gateway uses to discover workers without a registry service (in-process mode).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tandem.services.serving.cluster_view import record_replicas

ROUTE_TO = "route_to"


class TandemRequestRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        target = None if pending_request is None else pending_request.kwargs.get(ROUTE_TO)
        if target is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
        return [candidate_replicas]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        record_replicas(self._deployment_id.name,
                        frozenset(r.replica_id.unique_id for r in replicas))
