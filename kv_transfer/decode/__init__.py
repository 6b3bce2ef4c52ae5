"""The decode side: the manager (manager.py), one KVReceiver per room (receiver.py), one PeerLink per prefill
worker's bootstrap server (peer_link.py)."""
