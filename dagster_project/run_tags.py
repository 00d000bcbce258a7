"""The tags on the runs the schedules and sensors launch: the sensors find runs in flight by them."""

DRAIN_TAG = "cdc/drain"  # every drain run: the slot it drains
MERGES_TAG = "cdc/merges"  # a drain run that also merges (``schedule.merge_with_drain``): the slot
TABLE_TAG = "cdc/table"  # a table sensor's merge run: the table's slug
POINT_TAG = "cdc/point"  # a run of the consistent point's sensor: the slot
