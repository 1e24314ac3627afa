"""Google Cloud pieces shared by discovery, the cluster and the watchers: the Compute REST client,
GCE's notice constants and the price table."""
