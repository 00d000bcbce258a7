"""The one compiled module: binary COPY rows split into columns (cdc_assets/source/_copy_rows.c)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("cdc_assets.source._copy_rows", ["cdc_assets/source/_copy_rows.c"], extra_compile_args=["-O2"])
    ]
)
