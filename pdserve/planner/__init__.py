"""Placement planning (DistServe §4): ``search`` (phase units, Algorithm 1 and 2, colocated
candidates, the deployment file), ``advise`` (best colocated vs best disaggregated over SLO
scale and output length), ``replan`` (sliding-window shift detector, switching placements in
the simulator) and ``cli`` (``pdserve plan`` / ``pdserve advise``)."""
