"""Package discovery pyproject.toml cannot express: the demo adapters stay where the design card puts
them (checkpoints/demo/) and ship as the data package `jaxlora.demo_adapters`. Everything else about
the distribution is in pyproject.toml, which explains what is installed and why."""

from setuptools import find_packages, setup

DEMO_ADAPTERS = "jaxlora.demo_adapters"

setup(
    packages=[
        *find_packages(include=["jaxlora", "jaxlora.*", "pallas_kernels", "pallas_kernels.*", "serving", "serving.*"]),
        DEMO_ADAPTERS,
    ],
    package_dir={DEMO_ADAPTERS: "checkpoints/demo"},
)
