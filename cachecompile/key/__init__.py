"""What an entry is keyed by: computed on every first call, warm or cold.

``factors`` names the key's factors (the method's code and module, the backend as data,
config, versions, device, ranks), ``identity`` names functions, classes and values
portably, ``signature`` the per-call bucket, ``gears`` declared static shapes, ``passes``
custom passes and operators by what they do, ``deps`` the traced source files, ``ranks``
who this process is in a job. The key never imports the adapters, the entry format or the
package face (tests/test_layers.py).
"""
