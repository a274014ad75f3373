"""`tandem doctor`: the six serving questions from live metrics, and the levers ranked (no torch,
no Ray)."""
