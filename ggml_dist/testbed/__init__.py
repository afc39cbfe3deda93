"""The testbed: emulated hosts on one Linux machine, for measuring and testing distribution for real.

    netns.py          the network: a namespace per host on a private bridge, its own IP, a shaped link
    cgroups.py        a host's own CPU (a CFS quota with a short period) and memory, and their accounting
    procs.py          processes by pid (/proc), to find and end exactly what the testbed started
    envs.py           a Python environment without ggml_dist (a host that lacks the package)
    hosts.py          HostSpec: a host as data (Ray resources, CPU and memory budget, link, interpreter)
    cluster.py        NamespaceCluster: a Ray cluster of such hosts (`ray start --block` per host)
    reaper.py         which processes belong to a cluster, and ending exactly those
    probes.py         the scripts a cluster runs inside a host (the GCS's nodes, a TCP connect)
    diagnostics.py    what the hosts logged: Ray's session logs, the tails that explain a failed start
    link_cut.py       a streaming run whose stage-1 host loses its link mid-generation
    llamacpp_rpc.py   llama.cpp's RPC backend on the same hosts, the peer a pipeline is measured against

Nothing here imports the rest of ggml_dist: the tests and the benchmarks (`ggml-dist bench cluster`)
both build on it. Everything needs root; netns_available() and cgroups_available() say why not.
"""
