"""What runs a model's forwards: a `Forward` chosen once per model (choose.py), the lean forward,
its compiled layers, the static path, int8 layers and exact tree attention."""
