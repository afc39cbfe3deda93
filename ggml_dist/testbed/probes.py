"""Scripts a testbed cluster runs inside a host's namespace (python -c), where this process cannot reach."""
from __future__ import annotations

# Waits (in a host's namespace) until the GCS at `address` lists every ip in `alive` as an alive
# node and none in `dead`, then prints ray.nodes() as JSON. Needs no driver (no ray.init).
NODES_PROBE = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from ray._private.internal_api import get_state_from_address
deadline = time.monotonic() + args["timeout"]
state, nodes, err = None, None, None
while True:
    try:
        if state is None:
            state = get_state_from_address(args["address"])
        nodes = state.node_table()
        err = None
    except Exception as e:
        state, nodes, err = None, None, repr(e)
    if nodes is not None:
        up = {n["NodeManagerAddress"] for n in nodes if n["Alive"]}
        if set(args["alive"]) <= up and not (set(args["dead"]) & up):
            break
    if time.monotonic() > deadline:
        print(json.dumps({"timeout": True, "error": err, "nodes": nodes}, default=str))
        sys.exit(3)
    time.sleep(args["poll"])
print(json.dumps(nodes, default=str))
"""

CONNECT_PROBE = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except OSError as e:
    print("fail", repr(e))
"""
