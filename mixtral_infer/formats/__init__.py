"""Swapping the fast modules in after loading, and the weight layouts of a model in memory.

``modules``: ``prepare_and_swap`` (what ``load_model`` calls once: the back-ends' layouts, then
``use_formats``), ``use_formats`` (each linear layer becomes the back-end ``kernels.linear``'s table
picks; attention, feed-forward and MoE blocks their fast classes) and those blocks; ``packing`` and
``quantizing``: a model already in memory put in (or out of) the layouts and formats the back-ends
read; ``measured``: the choices of a ``Tuning`` that depend on the machine, measured once.
"""
