"""The demo's shop: customers, orders and order lines, and two rounds of realistic changes."""

from typing import Any

import psycopg

SCHEMA = """
CREATE TYPE order_status AS ENUM ('draft', 'placed', 'paid', 'shipped', 'cancelled');
CREATE TABLE customers (
    id          bigint PRIMARY KEY,
    name        text NOT NULL,
    email       text,
    notes       text,                      -- large: stored out of line (TOAST)
    credit      numeric(12, 2) NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE customers ALTER COLUMN notes SET STORAGE EXTERNAL;
CREATE TABLE orders (
    id          bigint PRIMARY KEY,
    customer_id bigint NOT NULL REFERENCES customers,
    status      order_status NOT NULL,
    total       numeric(12, 2) NOT NULL,
    tags        text[],
    ordered_at  timestamptz NOT NULL
);
CREATE TABLE order_lines (
    order_id    bigint REFERENCES orders ON UPDATE CASCADE ON DELETE CASCADE,
    line_no     int,
    sku         text NOT NULL,
    quantity    int NOT NULL,
    price       numeric(10, 2) NOT NULL,
    PRIMARY KEY (order_id, line_no)
);
"""

INITIAL = """
INSERT INTO customers (id, name, email, notes, credit, created_at)
SELECT i, 'Customer ' || i, 'customer' || i || '@example.com',
       (SELECT string_agg(md5(i::text || ':' || j), ' ') FROM generate_series(1, 400) j),
       (i % 50) * 10.5, timestamptz '2026-01-01 00:00+00' + i * interval '1 hour'
FROM generate_series(1, 200) i;
INSERT INTO orders
SELECT i, 1 + i % 200, (enum_range(NULL::order_status))[1 + i % 4], 0, ARRAY['web', 'promo' || i % 3],
       timestamptz '2026-02-01 00:00+00' + i * interval '7 minutes'
FROM generate_series(1, 1000) i;
INSERT INTO order_lines
SELECT o, l, 'SKU-' || (o * 7 + l) % 97, 1 + (o + l) % 5, 2.50 + (o * l) % 40
FROM generate_series(1, 1000) o, generate_series(1, 3) l;
UPDATE orders o SET total = (SELECT sum(quantity * price) FROM order_lines WHERE order_id = o.id);
"""

ROUNDS = [
    # Round 1: new orders, payments, a price correction, a cancellation, a profile update that leaves
    # the large notes column untouched (sent as unchanged TOAST).
    """
    INSERT INTO orders SELECT i, 1 + i % 200, 'placed', 0, ARRAY['app'], now() FROM generate_series(1001, 1100) i;
    INSERT INTO order_lines SELECT o, 1, 'SKU-' || o % 97, 2, 9.99 FROM generate_series(1001, 1100) o;
    UPDATE orders SET total = 19.98 WHERE id > 1000;
    UPDATE orders SET status = 'paid' WHERE status = 'placed' AND id % 3 = 0;
    UPDATE order_lines SET price = price * 0.9 WHERE sku = 'SKU-7';
    UPDATE orders SET status = 'cancelled' WHERE id BETWEEN 10 AND 20;
    DELETE FROM order_lines WHERE order_id BETWEEN 10 AND 20;
    UPDATE customers SET email = 'vip' || id || '@example.com', credit = credit + 100 WHERE id % 10 = 0;
    """,
    # Round 2: an order renumbered (its key changes; lines follow by ON UPDATE CASCADE), deletions,
    # and the order lines of the old orders archived away with a TRUNCATE, then partly reloaded.
    """
    UPDATE orders SET id = 5000 WHERE id = 42;
    DELETE FROM orders WHERE status = 'cancelled';
    UPDATE customers SET name = name || ' (gold)' WHERE credit > 400;
    TRUNCATE order_lines;
    INSERT INTO order_lines SELECT id, 1, 'SKU-RELOAD', 1, total FROM orders WHERE id % 5 = 0;
    UPDATE orders SET status = 'shipped' WHERE status = 'paid' AND id % 2 = 0;
    """,
]


def create(conn: psycopg.Connection[Any]) -> None:
    conn.execute(SCHEMA)
    conn.execute(INITIAL)


def run_round(conn: psycopg.Connection[Any], number: int) -> None:
    with conn.transaction():
        conn.execute(ROUNDS[number])
