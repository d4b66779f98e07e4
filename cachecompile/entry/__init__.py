"""The stored entry's format: what a warm process reads back.

``files`` names an entry's files (torch-free, so ``cachectl`` shares them), ``values``
the tagged JSON of plain values, ``codeobj`` Dynamo's transformed bytecode as bytes,
``guards`` the portable guards and their checker.
"""
