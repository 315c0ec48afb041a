"""What the tests share: real local servers, the Kubernetes API double, campaign and job helpers."""
