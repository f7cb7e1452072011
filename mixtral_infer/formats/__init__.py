"""Weight formats as modules, swapped in for the reference model's after loading.

``modules``: one ``nn.Module`` per kind of weight and the blocks that join products, and
``use_formats``, the one function that swaps them in; ``linear``: the product of a float weight;
``packing`` and ``quantizing``: putting a loaded model's weights in the layouts and formats those
modules read; ``measured``: the choices of a ``Tuning`` that depend on the machine, measured once.
"""
