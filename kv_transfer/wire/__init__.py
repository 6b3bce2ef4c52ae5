"""What crosses between the two sides: proto glue and room events (messages.py, protogen.py), typed errors that
travel as codes (errors.py), the KV and aux layouts both sides check (layout.py, aux.py), and room ids derived
from a request body (room_ids.py)."""
