"""The slot's replication stream: the protocol, the receiving process and the reader the drain uses."""
