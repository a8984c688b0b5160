"""Imported last by the ranks' fork server (:func:`zeroimpl.integrations.launch.start_ranks_from_forkserver`):
moves every object the server holds by then, the preloaded modules' (torch's, transformers'), into the garbage
collector's permanent generation.

A forked rank shares the server's memory pages until it writes to them, and a collection writes to the header of
every object it walks: one full collection in a rank copied the whole preloaded heap, hundreds of megabytes, and
cost a tenth of a second or more per collection on 2 cores. Frozen objects are never walked again (nor scanned by
``gc.get_referrers``, which only what a rank creates after the fork can refer to for this purpose); they are never
freed either, which the modules' objects never are anyway. Python's documentation of ``gc.freeze`` recommends this
for processes that fork without exec.
"""

import gc

gc.freeze()
