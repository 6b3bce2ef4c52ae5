"""Ways to run a SplitServe cluster: ``splitserve up`` on one machine (``deploy.local``), a Ray launcher
(``python -m deploy.ray.launch``) and a Helm chart (``deploy/helm/splitserve``). See docs/deploy.md."""
