"""kvstack.compiled — torch.compile implementations of the reference operations.

Each function names the reference function it implements and is checked against it by
``spec_tests/test_equivalence.py`` (through the op registry). Runs on CPU (inductor's C++
backend) and on CUDA. Importing this package compiles nothing; the first call does.
"""
