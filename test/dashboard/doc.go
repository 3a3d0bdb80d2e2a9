// Package dashboard checks the Helm chart's Grafana dashboard against a
// real Prometheus query engine over real scrapes of running agents. It is
// its own module so the root module does not depend on Prometheus's server.
package dashboard
