-- The seed lesson's business table, for the example below and the tests:
-- a registration moves from PENDING_PAYMENT to CONFIRMED, and every change
-- bumps version, which is also the version of the event it produces.
--
-- Requirements from the lesson: registration.id unique, version not null.
-- Payment and capacity checks happen before the update.
CREATE TABLE IF NOT EXISTS registration (
    id      uuid   PRIMARY KEY,
    status  text   NOT NULL CHECK (status IN ('PENDING_PAYMENT', 'CONFIRMED')),
    version bigint NOT NULL
);

-- This database's outbox belongs to the registration service, and the
-- seed's CTE below does not name an aggregate type: the column default
-- gives its events the type `registration`, so they land on
-- outbox.registration.<id>, the subjects the README's and docs/consumer.md's
-- filter (outbox.registration.>) receives. Apply after sql/outbox.sql.
ALTER TABLE outbox ALTER COLUMN aggregate_type SET DEFAULT 'registration';

-- Confirming a registration and recording its event in one statement (the
-- seed's data-modifying CTE, unchanged; :name marks a bound parameter). Only
-- a row the conditional UPDATE changed reaches `confirmed`, so the inserted
-- version always comes from this update; zero rows returned means no event
-- happened, and the caller must look at the registration's state instead.
-- If the outbox INSERT fails, the whole transaction rolls back.
--
-- The relay publishes the row as subject outbox.registration.<id>: the
-- CTE leaves aggregate_type to the column default set above. The uuid id
-- goes into the text aggregate_id column through PostgreSQL's assignment
-- cast from uuid to text.
--
-- BEGIN EXAMPLE confirm_registration
-- WITH confirmed AS (
--     UPDATE registration
--     SET status = 'CONFIRMED', version = version + 1
--     WHERE id = :registration_id
--       AND status = 'PENDING_PAYMENT'
--       AND version = :expected_version
--     RETURNING id, version
-- )
-- INSERT INTO outbox (
--     event_id, aggregate_id, aggregate_version,
--     event_type, payload, occurred_at, publish_state
-- )
-- SELECT :event_id, id, version, 'RegistrationConfirmed',
--        jsonb_build_object('registrationId', id, 'version', version),
--        CURRENT_TIMESTAMP, 'PENDING'
-- FROM confirmed
-- RETURNING event_id, aggregate_version;
-- END EXAMPLE
