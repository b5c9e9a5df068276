"""The Ray Serve HTTP endpoint: config, API models, auth, reference store, renderer and ingress
deployments. The application is wired in snapref_ray/serve/app.py; `snapref-ray serve` runs it locally."""
