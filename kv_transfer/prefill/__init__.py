"""The prefill side: the manager and its bootstrap gRPC server (manager.py, bootstrap_server.py), one KVSender per
room (sender.py), one DecodePeer per registered decode manager (peers.py) with the PageWriter that moves its pages
(page_writers.py)."""
