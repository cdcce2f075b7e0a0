# syntax=docker/dockerfile:1
#
# The outbox-relay image: a static binary on distroless, running as a
# non-root user.
#
#   docker build -t outbox-relay --build-arg VERSION=$(git describe --always) .
#   docker run --rm -v $PWD/relay.yaml:/etc/outbox-relay/config.yaml:ro \
#     -e OUTBOX_RELAY_POSTGRES_URL=... -p 9187:9187 outbox-relay
#
# The configuration file is mounted at /etc/outbox-relay/config.yaml (the
# image holds none); set http.listen to 0.0.0.0:9187 in it so the metrics
# port is reachable from outside the container (testdata/compose.yaml does).

FROM golang:1.26 AS build
WORKDIR /src
# Dependencies first: this layer is reused while only the sources change.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
ARG VERSION=dev
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/outbox-relay ./cmd/outbox-relay

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/outbox-relay /usr/local/bin/outbox-relay
# nonroot is uid 65532 in distroless images.
USER nonroot:nonroot
EXPOSE 9187
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["run", "--config", "/etc/outbox-relay/config.yaml"]
