"""kvstack.compiled — fast implementations of the reference operations.

Each function names the reference function it implements and is checked against it by
``spec_tests/test_equivalence.py`` (through the op registry). Runs on CPU (inductor's C++
backend) and on CUDA. Importing this package compiles nothing; the first call does.
``token_tables.TokenTableBatch`` is the one piece of state here: N reference token tables
vectorised in eager PyTorch (checked by ``spec_tests/test_token_table_batch.py``).
``attention.decode_attention`` is eager too: batched matmuls on gathered rows beat a compiled
graph's per-call cost at decode sizes (its docstring has the numbers).
"""
