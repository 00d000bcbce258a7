"""Two rounds of transactions on the code location's three tables (``tests/support/dagster_env.py``'s
``DDL``), with the change records each brings to the change log and the rows each merge changes in
Delta, per table."""

from __future__ import annotations

from tests.support.dagster_env import TABLES

CUSTOMERS, ORDERS, NOTES = TABLES

# Round 1 leaves public.notes idle; round 2 changes public.notes only. Every statement changes one
# row, so the change records per table are the statements per table.
ROUND_1 = [
    [
        "INSERT INTO public.customers VALUES (6, 'customer 6', 'bronze', DATE '2024-02-01')",
        "INSERT INTO public.orders VALUES (7, 6, 'draft', 70)",  # filtered out
    ],
    [
        "UPDATE public.customers SET tier = 'gold' WHERE id = 1",
        "UPDATE public.orders SET status = 'paid' WHERE id = 3",  # moves into the row filter
        "UPDATE public.orders SET status = 'draft' WHERE id = 2",  # moves out of it
    ],
    [
        "DELETE FROM public.customers WHERE id = 5",
        "DELETE FROM public.orders WHERE id = 4",
        "INSERT INTO public.customers VALUES (7, 'customer 7', 'silver', DATE '2024-02-02')",
        "INSERT INTO public.orders VALUES (8, 7, 'paid', 80)",
    ],
]
ROUND_1_CHANGES = {CUSTOMERS: 4, ORDERS: 5}
ROUND_1_MERGED = {CUSTOMERS: (2, 1, 1), ORDERS: (2, 0, 2)}  # (inserted, updated, deleted) in Delta
ROUND_2 = [
    ["INSERT INTO public.notes VALUES (4, 'note 4', 4)", "UPDATE public.notes SET body = 'edited' WHERE id = 1"],
    ["DELETE FROM public.notes WHERE id = 2"],
]
ROUND_2_CHANGES = {NOTES: 3}
# public.notes is REPLICA IDENTITY FULL: its rows match on every column, so Delta replaces an
# updated row (one delete, one insert) rather than updating it.
ROUND_2_MERGED = {NOTES: (2, 0, 2)}
