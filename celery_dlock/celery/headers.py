"""The message headers celery_dlock adds to the tasks it publishes or marks.

Celery keeps custom headers on a retry's message, so the counts below survive retries. Kept
apart so that the publish path, the task and the beat hook can all name them without
importing one another.
"""

from __future__ import annotations

HEADER_REQUEUES = "dlock_requeues"  # requeues of a duplicate so far
HEADER_UNAVAILABLE = "dlock_unavailable"  # requeues because Redis was unreachable so far
HEADER_QUEUED = "dlock_queued"  # the message holds a queued lock (enqueue-time mode)
HEADER_DUPLICATE_OF = "dlock_duplicate_of"  # published while this task id held the key
HEADER_REDELIVERED = "dlock_redelivered"  # requeues of a redelivered copy of a running task
HEADER_TICK = "dlock_tick"  # "<entry name>:<slot index>" of a beat send
HEADER_BEAT = "dlock_beat"  # "<host>:<pid>" of the beat process that sent it

#: The headers a worker's requeue of a message adds (duplicates.requeue): a message carrying
#: one was judged by the worker already, and is never taken for a new call at publish.
REQUEUE_HEADERS = (HEADER_REQUEUES, HEADER_UNAVAILABLE, HEADER_REDELIVERED)
