-- The transactional outbox table of the seed lesson. Services insert one row
-- per event in the same transaction as their business change; outbox-relay
-- streams the INSERTs from the WAL (publication.sql) and never reads the table.
--
-- aggregate_type is optional for writers: its default keeps the seed's own
-- INSERT (which does not name it) working, and the relay falls back to the
-- table name when it is empty.
--
-- An existing table gains the trace context columns with
--   ALTER TABLE outbox ADD COLUMN IF NOT EXISTS traceparent text,
--                      ADD COLUMN IF NOT EXISTS tracestate text;
CREATE TABLE IF NOT EXISTS outbox (
    event_id          uuid        NOT NULL,
    aggregate_type    text        NOT NULL DEFAULT '',
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    payload           jsonb       NOT NULL,
    occurred_at       timestamptz NOT NULL DEFAULT CURRENT_TIMESTAMP,
    publish_state     text        NOT NULL DEFAULT 'PENDING'
        CHECK (publish_state IN ('PENDING', 'PUBLISHED')),
    -- The W3C trace context of the writer's span (outbox.Writer fills them
    -- from its ctx); the relay maps them to the traceparent and tracestate
    -- headers. Optional: NULL, or absent in tables created without them.
    traceparent       text,
    tracestate        text,
    CONSTRAINT outbox_event_id_key UNIQUE (event_id),
    -- One event per aggregate version: the relay and consumers rely on the
    -- version to order and de-duplicate an aggregate's events.
    CONSTRAINT outbox_aggregate_version_key UNIQUE (aggregate_id, aggregate_version)
);
