"""The SLO planner (``tandem plan``): prefill and decode worker counts from TTFT/TPOT targets,
a measured per-worker profile and the live load; applied to a RayService. No torch, no Ray."""
