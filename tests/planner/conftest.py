from tests.deploy.conftest import helm, helm_binary  # noqa: F401  (the chart renders the RayService)
