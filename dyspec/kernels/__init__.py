"""C++ kernels of the CPU forwards, built on first use with one helper (build.py)."""
