"""Packages are found, not listed: every folder under neuron_constrain/ with an __init__.py ships, so a new
subpackage can never be left out of the wheel (tests/test_packaging.py compares the wheel with the tree).
passes/ and kernels/ are top-level folders installed as neuron_constrain.passes / .kernels (package_dir in
setup.cfg). Everything else about the package is in setup.cfg."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["neuron_constrain", "neuron_constrain.*"])
      + ["neuron_constrain.passes", "neuron_constrain.kernels"])
