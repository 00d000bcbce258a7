"""The one compiled module: binary COPY rows split into columns (cdc_assets/source/_copy_rows.c).

Optional: where it cannot be compiled (no C compiler), the install goes on without it and copies
split rows in pure Python (cdc_assets/source/copy_rows.py chooses)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cdc_assets.source._copy_rows",
            ["cdc_assets/source/_copy_rows.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
