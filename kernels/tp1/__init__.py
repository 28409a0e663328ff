"""`fused_tp1`'s kernels (world size 1: nothing to exchange), one launch per call:

- whole rows (`whole_rows`): one program per row keeps the row's top-k finalize in registers,
  rounds it once as a published partial would be, adds the residual, normalizes and quantizes.
- split rows (`split_rows`, few rows): a row's columns are spread over several programs, so a
  row's K gathers run on several SMs at once instead of one SM serially. A program finalizes and
  stores its chunk, publishes its chunk's sum of squares, waits for the row's other chunks' sums
  (the exchange, inside the launch) and normalizes and quantizes its own columns; per token
  (dynamic FP8) a second exchange, of the chunks' amaxes of the normalized row, gives the row its
  one scale. The protocol and its memory-ordering argument are in split_rows.py.

`configs` picks the launch config per T; `launcher.Tp1Launcher` binds a layer once and launches
through the launch cache.
"""
