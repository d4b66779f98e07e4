"""The warm path: rebuilding a stored entry into a callable method, with torch only
(no Dynamo, no compiler). Never imports ``cold`` (tests/test_layers.py)."""
