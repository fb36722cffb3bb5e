"""The models' Triton kernels. Each module holds one kernel, its launcher and the torch computation it is tested
against (tests/helpers/triton_interpreted_checks.py on the CPU, tests/gpu/ on a GPU).

Triton is optional and slow to import: a module here gets it only through triton_launcher.py, the first time a
kernel is wanted on CUDA, so importing this package (or any module of it) costs nothing on a machine without it.
"""
