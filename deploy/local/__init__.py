"""``splitserve up``: the whole cluster as processes on this machine (``deploy.local.up.main``)."""
