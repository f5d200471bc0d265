"""`python -m tide_jax.info`: prints `tide_jax.info()`, the block to paste into a bug report
(python/tide_jax/_info.py says what it holds).

From Python call `tide_jax.info()`; `import tide_jax.info` would replace that function by this
module, so the report lives in `_info` and this file only runs it.
"""

if __name__ == "__main__":
    import sys

    from tide_jax._info import main

    sys.exit(main())
